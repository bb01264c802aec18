"""The request types and the wire protocol that the engine and the server both speak.

SamplingParams (and StructuredOutput, RequestOutputKind), the structured-output request check,
RequestOutput / CompletionOutput, the tokenizer facade, OutputText, EngineStats, the msgpack
messages between the server's processes, and `validate_request`: the one check of a request
against the model's limits. Nothing here imports torch or the engine, so the server's front-end
process (HTTP, tokenizing, detokenising) runs without either (docs/design-notes.md, "The protocol
package").
"""
