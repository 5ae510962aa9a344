"""The `local` backend of `trainer.backend.WorkerGroup`: actor, critic and reference policy in one process on one
device (`backend.LocalBackend`), their Hugging Face models and forward passes (`models`), LoRA (`lora`)."""
