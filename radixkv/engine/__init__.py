"""Engine: requests, sampling, detokenizer, scheduler, the synchronous ``LLMEngine`` (one step =
schedule -> run -> postprocess), the ``AsyncEngine`` bridge, LoRA adapter lifecycle and stats."""
