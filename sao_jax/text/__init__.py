"""Text: tokenizers (character-level and Hugging Face) and chat templates."""
