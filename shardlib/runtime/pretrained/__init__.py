"""pretrained."""
