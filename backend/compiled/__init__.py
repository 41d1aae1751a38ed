"""Whole programs: `torch.compile` on tpu, compiled steps, a module's forward and an optimizer's step as one program."""
