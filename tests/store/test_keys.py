"""Content-addressed keys: stable across processes, distinct across model, prefix, tokens and version."""

from __future__ import annotations

import subprocess
import sys

from cacheblend_rag.store.format.keys import chunk_key


def test_key_is_stable_across_processes():
    code = "from cacheblend_rag.store.format.keys import chunk_key; print(chunk_key('model-a', [1, 2, 3], [9]))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == chunk_key("model-a", [1, 2, 3], [9])
    # A literal, so that a change of the key derivation (which orphans every store) is deliberate. Format
    # version 4 (the manifest's key id) did so: version 3's entries are never looked up by this code.
    assert chunk_key("model-a", [1, 2, 3], [9]) == "2486363216f1a525f4c8802d2118c3022d13596699f5a137d54684181d9681ba"
    assert chunk_key("model-a", [1, 2, 3], [9], format_version=3) == \
        "11804ca3b843284eeb84e731a7fd85c700a58bd34d6b81bce34b53be4d5349c5"


def test_every_input_changes_the_key():
    base = chunk_key("model-a", [1, 2, 3], [9])
    variants = {
        chunk_key("model-b", [1, 2, 3], [9]),
        chunk_key("model-a", [1, 2, 4], [9]),
        chunk_key("model-a", [1, 2, 3], []),
        chunk_key("model-a", [1, 2, 3], [9], format_version=1),
        # the same ids split differently between prefix and chunk
        chunk_key("model-a", [9, 1, 2, 3], []),
        chunk_key("model-a", [2, 3], [9, 1]),
        # lossy codecs get keys of their own, one per group size
        chunk_key("model-a", [1, 2, 3], [9], codec_tag="int8-g64"),
        chunk_key("model-a", [1, 2, 3], [9], codec_tag="int8-g32"),
        chunk_key("model-a", [1, 2, 3], [9], codec_tag="int4-g64"),
    }
    assert base not in variants and len(variants) == 9


def test_keys_of_a_real_engine_depend_on_its_weights():
    from cacheblend_rag.testing import tiny_engine

    a, b = tiny_engine(seed=0), tiny_engine(seed=1)
    assert a.fingerprint != b.fingerprint
    assert chunk_key(a.fingerprint, [5, 6]) != chunk_key(b.fingerprint, [5, 6])
