"""The orchestration layer: prompts in, sequences through the step loop, completions out."""
