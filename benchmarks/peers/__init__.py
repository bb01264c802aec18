"""Peer benchmarks, Strata vs llama.cpp vs transformers; entry point peers.py (run by run.sh)."""
