# ffcv-ddpm: every target sets itself up on first use (.venv + pinned requirements + FFCV, see setup/install.sh).
# On a machine that already has the packages (e.g. a GPU box with torch preinstalled): make bench NO_SETUP=1 PY=python3

VENV ?= .venv
PY ?= $(VENV)/bin/python
STAMP := $(VENV)/.installed
SETUP := $(if $(NO_SETUP),,$(STAMP))

# make dataset: SOURCE=download (default) | tarball (CIFAR=path/to/cifar-10-python.tar.gz) | png (PNG_DIR=path) | synthetic
#               | digits (scikit-learn's bundled digits -> data/digits) | mnist (MNIST_DIR=path of IDX files -> data/mnist)
SOURCE ?= $(if $(CIFAR),tarball,$(if $(PNG_DIR),png,$(if $(MNIST_DIR),mnist,download)))
DATA ?= $(if $(filter digits mnist,$(SOURCE)),data/$(SOURCE),data)
JPEG_QUALITY ?= 90
PRESET ?= ddpm-cifar10
ARGS ?=

.PHONY: setup test dataset dataset-png bench bench-loaders sweeps train profile bench-ddp numerics sde-quality fid quality compress clean

setup: $(SETUP)

$(STAMP): requirements.txt setup/install.sh pyproject.toml
	VENV=$(VENV) bash setup/install.sh

test: $(SETUP)
	$(PY) -m pytest -q tests

dataset: $(SETUP)
	$(PY) -m tools.make_dataset --source $(SOURCE) --out $(DATA) --jpeg-quality $(JPEG_QUALITY) \
		$(if $(CIFAR),--tarball $(CIFAR)) $(if $(PNG_DIR),--png-dir $(PNG_DIR)) $(if $(MNIST_DIR),--mnist-dir $(MNIST_DIR)) \
		$(ARGS)

# The .beton files plus the Kaggle-layout PNG folder $(DATA)/png, for the PyTorch-DataLoader-from-files baseline
# (make bench and make bench-loaders use it when present).
dataset-png: $(SETUP)
	$(MAKE) dataset ARGS="--export-png $(DATA)/png $(ARGS)"

bench: $(SETUP)
	$(PY) -m benchmarks.bench --data $(DATA) $(ARGS)

bench-loaders: $(SETUP)
	$(PY) -m benchmarks.loaders --data $(DATA) $(ARGS)

# DDP scaling of the trainer on 1, 2, 4 GPUs of this host (torchrun; NVLink multicast kept off in every rank).
bench-ddp: $(SETUP)
	NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
		$(PY) -m benchmarks.ddp --data $(DATA) --preset $(PRESET) $(ARGS)

profile: $(SETUP)
	$(PY) -m benchmarks.profile --preset $(PRESET) --data $(DATA) $(ARGS)

numerics: $(SETUP)
	$(PY) -m benchmarks.numerics --preset $(PRESET) --data $(DATA) $(ARGS)

# Quality vs NFE of every sampler on a VE and a DDPM model trained on the digits (make dataset SOURCE=digits first).
sde-quality: $(SETUP)
	$(PY) -m benchmarks.sde_quality --data $(DATA)/digits --out $(or $(OUT),benchmarks/results/sde-quality) $(ARGS)

# FID of a run's samples against the train split: make fid RUN=runs/00000-ddpm-cifar10 ARGS="--n 10000"
# (or ARGS="--images PATH" to score an image set); Inception weights from the torch hub cache, never downloaded.
fid: $(SETUP)
	$(PY) -m benchmarks.fid --data $(DATA)/cifar10_train_raw.beton $(if $(RUN),--run $(RUN)) $(ARGS)

# Sample quality on the digits (builds data/digits if missing): judge, class-conditional training, FD-digits and
# conditional accuracy per guidance weight and sampler. ~6 minutes on one H100/H200; see benchmarks/quality.py.
quality: $(SETUP)
	$(PY) -m benchmarks.quality --data data/digits $(ARGS)

# Compression study: pruning, grouped/depthwise-separable convs, int8 (torchao) with size, speed and quality. Trains
# the digits model first, or studies RUN=runs/... (e.g. the run of make quality). ~6-7 minutes on one H100/H200.
compress: $(SETUP)
	$(PY) -m benchmarks.compress $(RUN) --data data/digits $(if $(OUT),--out $(OUT)) $(ARGS)

sweeps: $(SETUP)
	$(PY) -m benchmarks.sweeps --data $(DATA) $(ARGS)

train: $(SETUP)
	$(PY) -m ffcv_ddpm.train --preset $(PRESET) --data $(DATA)/cifar10_train_raw.beton $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
