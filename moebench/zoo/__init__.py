"""The tiny MoE model zoo: a trained Qwen3-MoE in Hugging Face and GGUF form from the same weights.

`moebench.zoo.build.build_zoo(out_dir)` is the entry point (`moebench zoo build`); see docs/zoo.md.
"""
