"""One module per file format; each exposes ``load(path, image_size, seed, num_classes)``."""
