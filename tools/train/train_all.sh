#!/usr/bin/env bash
# Retrains every bundled model from scratch (CPU: about 75 minutes on 2 cores for the VQ/GPT
# family, about 30 for the text-to-image fmnist-t2i, then about 60 more on one thread for the
# KL/MAR family; the logs in models/*/train_log.jsonl record the runs whose weights are
# committed).
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-/opt/imagegen/venv/bin/python}"
"$PY" train_vq.py
"$PY" train_classifier.py
"$PY" train_gpt.py --name fmnist-gpt --preset target
"$PY" train_gpt.py --name fmnist-draft --preset draft --steps 1000
"$PY" train_t2i.py
"$PY" train_kl.py
"$PY" train_mar.py --preset draft
"$PY" train_mar.py --preset target
