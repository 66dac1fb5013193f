"""Pure planning: layouts, cost model, shard maps, packing. Imports neither torch.distributed nor megatron."""
