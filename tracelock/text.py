"""Prompt encoding with the checkpoint's chat template, and answer extraction from a generated region."""


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> list:
    """Token ids of one user prompt, rendered with the chat template when the tokenizer has one."""
    if chat and tokenizer.chat_template:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                               add_generation_prompt=True)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def answer_ids(generated: list, end_ids) -> list:
    """The generated ids up to (not including) the first end token."""
    for i, t in enumerate(generated):
        if t in end_ids:
            return generated[:i]
    return generated


def decode_answer(tokenizer, generated: list, end_ids) -> str:
    return tokenizer.decode(answer_ids(generated, end_ids), skip_special_tokens=True)
