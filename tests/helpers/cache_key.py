"""Print the cache directory name create_pretrain_dataset would use (run in a fresh process, so
tests/test_data.py can check the key does not depend on this process's hash() seed).

    python tests/helpers/cache_key.py TOKENIZER_DIR DATA CACHE
"""

import sys

from utils.data.data_utils import pretrain_cache_dir
from utils.data.tokenizer import load_tokenizer

tok_dir, data, cache = sys.argv[1:4]
tokenizer = load_tokenizer(tok_dir)
print(pretrain_cache_dir(data, "90,10", cache, seed=1, tokenizer=tokenizer, max_seq_len=32).name)
