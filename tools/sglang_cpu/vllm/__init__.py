"""earl_megatron's stand-in for the single vllm op SGLang's CPU path imports (test servers only;
installed into the SGLang venv by tools/sglang_cpu/setup.sh, never into the project's)."""
