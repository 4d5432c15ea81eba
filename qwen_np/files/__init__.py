"""Files: safetensors checkpoints (`checkpoint`), GGUF files (`gguf_reader`: the layout checked and the file
parsed; `gguf_metadata`: the config, sampling defaults and tensor names; `gguf_tokenizer`: the tokenizer,
read and written; `gguf_file`: GGUFCheckpoint, the weights; `gguf_export`: writing one), the tokenizer and
chat template (`tokenizer`), a chat's messages and tools as the template reads them (`messages`), and one
opened model's files, whatever holds them (`model_files`: config, tokenizer, generation defaults, tensors;
the one place that tells a GGUF file from a folder).

May import: core/, numbers/, qwen_np.errors.
"""
