"""nn modules whose PyTorch fast paths need the device's own route: attention, recurrent layers, the Transformer's
fast path, lazy modules."""
