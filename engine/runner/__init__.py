"""The model runner: persistent input batch, `prepare_inputs`, the forward pass and sampling."""
