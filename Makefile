# ffcv-ddpm: every target sets itself up on first use (.venv + pinned requirements + FFCV, see setup/install.sh).
# On a machine that already has the packages (e.g. a GPU box with torch preinstalled): make bench NO_SETUP=1 PY=python3

# Every variable below is this file's default or the command line's, never the environment's: a shell's (or a GPU
# machine's, or a CI system's) OUT, DATA or PY must not redirect what make writes, reads or runs.
COMMAND_LINE_ONLY := VENV PY NO_SETUP SOURCE CIFAR PNG_DIR MNIST_DIR DATA OUT JPEG_QUALITY PRESET ARGS RUN
$(foreach v,$(COMMAND_LINE_ONLY),$(if $(filter environment%,$(origin $(v))),$(eval undefine $(v))))

VENV ?= .venv
PY ?= $(VENV)/bin/python
STAMP := $(VENV)/.installed
SETUP := $(if $(NO_SETUP),,$(STAMP))

# make dataset: SOURCE=download (default) | tarball (CIFAR=path/to/cifar-10-python.tar.gz) | png (PNG_DIR=path) | synthetic
#               | digits (scikit-learn's bundled digits -> data/digits) | mnist (MNIST_DIR=path of IDX files -> data/mnist)
SOURCE ?= $(if $(CIFAR),tarball,$(if $(PNG_DIR),png,$(if $(MNIST_DIR),mnist,download)))
DATA ?= $(if $(filter digits mnist,$(SOURCE)),data/$(SOURCE),data)
# OUT=DIR: where a target writes, for every target that writes (make dataset: the dataset folder, else $(DATA);
# the benchmarks: their --out; make train: train.out_dir). The digits studies read DATA when it is given, else data/digits.
OUT ?=
OUT_ARG = $(if $(OUT),--out "$(OUT)")
DIGITS = $(if $(filter command line,$(origin DATA)),$(DATA),data/digits)
JPEG_QUALITY ?= 90
PRESET ?= ddpm-cifar10
ARGS ?=

.PHONY: setup test test-quick dataset dataset-png cutlass bench bench-loaders sweeps train profile bench-ddp numerics sde-quality fid quality compress ledger clean

setup: $(SETUP)

$(STAMP): requirements.txt setup/install.sh pyproject.toml
	VENV="$(VENV)" bash setup/install.sh

# One pytest-xdist worker per core. worksteal: each worker starts on a contiguous half of the tests (a module's
# fixtures are built once), then takes tests from the end of the other's queue. (--dist loadgroup groups nothing
# with pytest 9.2: xdist 3.8 renames item._nodeid, which pytest no longer reads.)
test: $(SETUP)
	$(PY) -m pytest -q -n auto --dist worksteal tests

# The same without the tests tests/durations.txt records at 5 s or more (tests/conftest.py's --quick): a contributor's
# edit-and-run loop. make test, what CI runs, runs every test.
test-quick: $(SETUP)
	$(PY) -m pytest -q -n auto --dist worksteal --quick tests

dataset: $(SETUP)
	$(PY) -m tools.make_dataset --source $(SOURCE) --out "$(or $(OUT),$(DATA))" --jpeg-quality $(JPEG_QUALITY) \
		$(if $(CIFAR),--tarball "$(CIFAR)") $(if $(PNG_DIR),--png-dir "$(PNG_DIR)") \
		$(if $(MNIST_DIR),--mnist-dir "$(MNIST_DIR)") $(ARGS)

# The .beton files plus the Kaggle-layout PNG folder <dataset folder>/png, for the PyTorch-DataLoader-from-files
# baseline (make bench and make bench-loaders use it when present; make bench ARGS="--table loaders-e2e" needs it:
# without it that table stops before any row runs). Give the SOURCE the .beton files were made from.
dataset-png: $(SETUP)
	$(MAKE) dataset ARGS="--export-png '$(or $(OUT),$(DATA))/png' $(ARGS)"

# CUTLASS's sm90 convolution for model.conv_cutlass (H100/H200): nvcc, and CUTLASS's headers fetched by pip once
# (ffcv_ddpm/conv_cutlass.py; .cutlass/build/libconv_fprop-<hash>.so).
cutlass: $(SETUP)
	$(PY) -m ffcv_ddpm.conv_cutlass

bench: $(SETUP)
	$(PY) -m benchmarks.speed.bench --data "$(DATA)" $(OUT_ARG) $(ARGS)

bench-loaders: $(SETUP)
	$(PY) -m benchmarks.speed.loaders --data "$(DATA)" $(OUT_ARG) $(ARGS)

# DDP scaling of the trainer on 1, 2, 4 GPUs of this host (torchrun; NVLink multicast kept off in every rank).
bench-ddp: $(SETUP)
	NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
		$(PY) -m benchmarks.speed.ddp --data "$(DATA)" --preset $(PRESET) $(OUT_ARG) $(ARGS)

# The index of every committed result (benchmarks/results/README.md), rebuilt from the JSON files after new results
# land; tests/test_ledger.py fails while it is stale.
ledger: $(SETUP)
	$(PY) -m benchmarks.ledger $(ARGS)

profile: $(SETUP)
	$(PY) -m benchmarks.speed.profile --preset $(PRESET) --data "$(DATA)" $(OUT_ARG) $(ARGS)

numerics: $(SETUP)
	$(PY) -m benchmarks.speed.numerics --preset $(PRESET) --data "$(DATA)" $(OUT_ARG) $(ARGS)

# The studies sized for one H100/H200 say so up front where there is no CUDA: their training alone is PFLOPs, hours on
# a CPU (e.g. compress: 1,500 steps of 256 images at 9.5 GFLOP each, ~3.7 PFLOP).
CPU_NOTE = @$(PY) -c 'import sys, torch; torch.cuda.is_available() or print("make $@: no CUDA GPU here: this study is \
	sized for one H100/H200 (minutes there); on a CPU it runs for hours (Ctrl-C stops it)", file=sys.stderr, flush=True)'

# Quality vs NFE of every sampler on a VE and a DDPM model trained on the digits (make dataset SOURCE=digits first).
# Results in benchmarks/results/<card>/sde-quality unless OUT=DIR.
sde-quality: $(SETUP)
	$(CPU_NOTE)
	out="$(or $(OUT),$$($(PY) -c 'from benchmarks.common import results_here; print(results_here() / "sde-quality")'))" \
		&& $(PY) -m benchmarks.quality.sde --data "$(DIGITS)" --out "$$out" $(ARGS)

# FID of a run's samples against the train split: make fid RUN=runs/00000-ddpm-cifar10 ARGS="--n 10000"
# (or ARGS="--images PATH" to score an image set); Inception weights from the torch hub cache (downloaded once, checked).
fid: $(SETUP)
	$(PY) -m benchmarks.quality.fid --data "$(DATA)/cifar10_train_raw.beton" $(if $(RUN),--run "$(RUN)") $(OUT_ARG) \
		$(ARGS)

# Sample quality on the digits (builds data/digits if missing): judge, class-conditional training, FD-digits and
# conditional accuracy per guidance weight and sampler. ~7.5 minutes on one H100/H200 (its --budget-s 470: 453 s on an
# H100, 445 s on an H200); see benchmarks/quality/digits.py.
quality: $(SETUP)
	$(CPU_NOTE)
	$(PY) -m benchmarks.quality.digits --data "$(DIGITS)" $(OUT_ARG) $(ARGS)

# Compression study: pruning, grouped/depthwise-separable convs, int8 (torchao) with size, speed and quality. Trains
# the digits model first, or studies RUN=runs/... (e.g. the run of make quality). ~8.5 minutes on one H100 (its
# --budget-s 485; the rows it leaves out run in a second call with --continue-from: 13.5 minutes in all).
compress: $(SETUP)
	$(CPU_NOTE)
	$(PY) -m benchmarks.quality.compress $(if $(RUN),"$(RUN)") --data "$(DIGITS)" $(OUT_ARG) $(ARGS)

sweeps: $(SETUP)
	$(PY) -m benchmarks.speed.sweeps --data "$(DATA)" $(OUT_ARG) $(ARGS)

train: $(SETUP)
	$(PY) -m ffcv_ddpm.train --preset $(PRESET) --data "$(DATA)/cifar10_train_raw.beton" \
		$(if $(OUT),"train.out_dir=$(OUT)") $(ARGS)

clean:
	rm -rf "$(VENV)" .pytest_cache
