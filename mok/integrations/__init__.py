"""Swaps of other libraries' MoE experts for mok, one module per client (DESIGN §9): `mok.integrations.hf` (Hugging Face
transformers) and `mok.integrations.torchtitan`. Each keeps the client's router, so the routing decision (top-k ids and
weights) is computed by the client's code and passed to `mok.moe`, and uses the client's own parameters (no copies:
optimizers, state_dicts and checkpoints keep working). Neither client is a dependency of mok: import the module of
the one you use (the `integrations` extra installs both)."""
