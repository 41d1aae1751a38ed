"""How one aten op on tpu tensors runs: dispatch, its arguments, its cached program, views and in-place writes."""
