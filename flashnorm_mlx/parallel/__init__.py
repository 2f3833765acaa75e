"""One model over several machines (docs/design.md section 5e).

- `sharding`: a model's `shard(group)`: q|k|v and gate|up split by rows, the
  out and down projections by columns and all-summed, by whole GQA groups;
- `distributed`: the launch under `mlx.launch`: joining, barriers, one error
  line per launch, and the watchdog that ends a rank whose peers are gone.
"""
