"""Reading and writing: the streamed checkpoint loader, NF4 quantization, merged export, training data."""
