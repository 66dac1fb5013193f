"""HF <-> Megatron-Core parameter mapping tables and conversion."""
