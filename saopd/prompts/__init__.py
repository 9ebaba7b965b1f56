"""Training prompts at run time: reading JSONL prompt files (text and with images), rendering
chat prompts to token ids, and the prompt-length filter. The DVC stages that *write* those files
are :mod:`saopd.stages`; the step's contexts built from sampled responses are
:mod:`saopd.contexts`."""
