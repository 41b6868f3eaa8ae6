"""Dataset tools (writing side): CIFAR-10 sources -> FFCV .beton files + manifest. Reading lives in ffcv_ddpm."""
