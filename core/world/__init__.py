"""The built-in mini world: procedural captioned scenes (scenes), their analytic checker (checker),
the prompt sources (prompts), the word-level tokenizer (tokenizer) and the model card (card).

Light on purpose: importing ``core.world`` pulls numpy and PIL only, never torch.
"""
