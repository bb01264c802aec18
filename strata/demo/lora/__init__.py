"""Demo LoRA adapters for the built-in demo model, trained by `strata train --lora` (sonnets.py)."""
