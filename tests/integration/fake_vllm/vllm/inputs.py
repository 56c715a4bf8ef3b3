"""`vllm.inputs.TokensPrompt` of the stand-in (see `vllm/__init__.py`)."""


def TokensPrompt(**kwargs):  # noqa: ANN001, ANN201, N802 - vllm's name
    return kwargs
