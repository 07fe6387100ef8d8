"""One process of tests/test_data.py's cache races: announce readiness, wait for the start
signal, build (or wait for) the dataset as local rank RANK, print what it got.

    python tests/helpers/race_builder.py TOKENIZER_DIR DATA CACHE RANK GO_FILE
"""

import hashlib
import os
import sys
import time
from pathlib import Path

from utils.data.data_utils import create_pretrain_dataset
from utils.data.tokenizer import load_tokenizer

tok_dir, data, cache, rank, go = sys.argv[1:6]
tokenizer = load_tokenizer(tok_dir)
Path(go + f".ready{os.getpid()}").touch()
while not Path(go).exists():
    time.sleep(0.01)
train, evl = create_pretrain_dataset(
    local_rank=int(rank),
    data_path=data,
    data_split="90,10",
    data_output_path=cache,
    seed=3,
    tokenizer=tokenizer,
    max_seq_len=32,
)
digest = hashlib.sha256(bytes(train.tokens) + b"|" + bytes(evl.tokens)).hexdigest()
print(train.path.parent.name, len(train), len(evl), digest)
