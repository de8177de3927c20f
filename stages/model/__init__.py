"""What the stages share of the model they train, below all of them: the repo's Llama
(``llama``), building it from a preset or an HF folder with its HF config and loss
(``lm``), and the byte tokenizer (``tokenizer``). The trainer trains it, the HF
exports view it as ``transformers``' class, data prep's ladder probe trains small
ones.

Light on purpose: importing ``stages.model`` (or its ``tokenizer`` module, which the
driver uses) pulls in no torch.
"""
