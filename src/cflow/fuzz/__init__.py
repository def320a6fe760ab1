"""Structure-aware fuzzing of the model-file loaders.

Three small but real base files (a GGUF with SmolLM2's own tokenizer cut to 512 tokens, its
.cflow conversion, and a Hugging Face safetensors directory of the same weights: `bases`) are
mutated field by field (`mutate`: header values, array counts, tensor tables, JSON values,
truncations, byte flips), and each mutant goes through the loaders, `verify`, `inspect`,
`convert` and a 4-token `generate` in a worker process (`worker`) that `run` watches: every
outcome is classified as a clear error, an accepted file with finite logits, or a failure (a
crash by signal, a hang, a traceback, unbounded memory, non-finite logits from an accepted
file). Mutants that fail are kept, as edits of their base, in the corpus the test suite replays
"""
