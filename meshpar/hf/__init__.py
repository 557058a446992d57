"""Hugging Face checkpoints in and out, for the Llama family (``model.name: llama``): Llamas, and
Mixtrals (a Llama whose every layer is a mixture of experts).

- :mod:`meshpar.hf.model_config`: ``config.json`` ↔ :class:`meshpar.models.llama.LlamaConfig`'s
  architecture fields (transformers 4 and 5 spellings), and the check that a run's model
  section agrees with a folder's.
- :mod:`meshpar.hf.reader`, :mod:`meshpar.hf.writer`: safetensors files, read one tensor at a
  time (``pread`` into a buffer of its own, never a map of the whole file) and written one
  tensor at a time; float32, float16 and bfloat16 (and the integer kinds), one file or shards
  with ``model.safetensors.index.json``.
- :mod:`meshpar.hf.names`: Hugging Face's tensor names and ``[out, in]`` matrices ↔ meshpar's
  parameter paths, stacked layers (a Mixtral's experts stacked over layers and experts) and
  ``[in, *out]`` matrices with heads split out.
- :mod:`meshpar.hf.place`: each tensor straight into its target sharding, a stacked parameter
  filled a layer at a time, so the host never holds more than a tensor or two at once.
- :mod:`meshpar.hf.load`, :mod:`meshpar.hf.export`: a folder → parameters in a run's shardings;
  a run's parameters → a folder ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

The commands are ``python -m meshpar.convert from-hf|to-hf`` and ``checkpoint.init_from``.
"""
