"""Converters from published DeepSeek V4.1 Flash checkpoints to dsv4 model directories."""
