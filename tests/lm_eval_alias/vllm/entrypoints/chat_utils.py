def resolve_hf_chat_template(tokenizer, chat_template=None, tools=None, **kwargs):
    """The template to render chats with: the one given, else the tokenizer's."""
    return chat_template or getattr(tokenizer, "chat_template", None)
