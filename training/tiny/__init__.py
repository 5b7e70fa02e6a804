"""kestrel-tiny's training: tokenizer, the training-side network, pre-training, the chat fine-tune and the draft
proposers (docs/kestrel-tiny.md).

What the runtime needs of kestrel-tiny stays in `kestrel.tiny`: where the bundled model lives and the stdlib
corpus with its held-out split.
"""
