"""Dedup: datasketch-identical signatures, the S-curve choice, planted near-duplicates
measured against exact all-pairs Jaccard, exact duplicates, the survivor rule."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from datasketch import MinHash

from stages.data_prep.config import DedupConfig
from stages.data_prep.dedup import dedup
from stages.data_prep.minhash import (
    candidate_probability,
    lsh_params,
    shingle_values32,
    signatures,
)
from stages.data_prep.synth import (
    cluster_pairs,
    planted_pair_corpus,
    precision_recall,
    similar_pairs_bruteforce,
    similar_pairs_exact,
)
from stages.data_prep.text import ngram_hashes, word_batch
from stages.errors import ErrorCode


def test_signatures_match_datasketch_minhash() -> None:
    texts = [
        "the cat sat on the mat and then it sat again",
        "short",
        "",
        "Janet\u2019s ducks lay 16 eggs per day; she eats three for breakfast.",
    ]
    grams = ngram_hashes(word_batch(texts), 3)
    sig = signatures(grams, num_perm=64, seed=7)
    values = shingle_values32(grams)
    for d in range(len(texts)):
        ref = MinHash(num_perm=64, seed=7, hashfunc=lambda x: x)
        ref.update_batch([int(v) for v in values[grams.doc == d]])
        np.testing.assert_array_equal(sig[d], ref.hashvalues)
    assert (sig[2] == np.uint32(0xFFFFFFFF)).all()  # empty document: empty sketch


def test_lsh_params_is_the_steepest_s_curve_meeting_the_recall_target() -> None:
    bands, rows = lsh_params(0.8, 128, recall_target=0.99)
    assert (bands, rows) == (21, 6)
    assert candidate_probability(0.8, bands, rows) >= 0.99
    # One more row per band would miss more than 1% of pairs at the threshold.
    assert candidate_probability(0.8, 128 // (rows + 1), rows + 1) < 0.99
    # The curve is an S: dissimilar pairs rarely become candidates.
    assert candidate_probability(0.3, bands, rows) < 0.02


def test_planted_near_duplicates_precision_and_recall_against_all_pairs_jaccard() -> None:
    texts, planted = planted_pair_corpus(300, 300, seed=3)
    truth = similar_pairs_bruteforce(texts, 5, 0.8)
    assert similar_pairs_exact(texts, 5, 0.8) == truth
    # The corpus really spans the range: pairs on both sides of the threshold.
    assert 60 <= len(truth) <= 240
    assert len(set(planted) - truth) >= 60
    result = dedup(texts, DedupConfig(threshold=0.8, num_perm=128, shingle_size=5))
    precision, recall = precision_recall(cluster_pairs(result.clusters), truth)
    assert precision >= 0.95 and recall >= 0.95, (precision, recall)
    assert result.near_duplicates == len(result.clusters)  # planted pairs, no chains
    assert result.keep.sum() == len(texts) - result.near_duplicates


def test_exact_duplicates_and_deterministic_survivor() -> None:
    texts, _ = planted_pair_corpus(50, 0, seed=4)
    a = texts[10]
    near = a.rsplit(" ", 1)[0] + " zzz"  # one word changed at the end
    corpus = [*texts, a, near, a]
    result = dedup(corpus)
    assert result.exact_duplicates == 2
    assert not result.keep[50] and not result.keep[52]
    assert result.clusters == [[10, 51]]  # survivor first: the lowest input index
    assert result.keep[10] and not result.keep[51]
    assert result.duplicate_of() == {51: 10}
    # Reordering the input moves the survivor with it: it is the first one seen.
    swapped = [*texts[:10], near, *texts[11:], a]
    again = dedup(swapped)
    assert again.clusters == [[10, 50]] and again.keep[10] and not again.keep[50]


@pytest.mark.parametrize("texts", [["", "", "   "], ["a", "b"], []])
def test_degenerate_inputs(texts: list[str]) -> None:
    result = dedup(texts)
    assert result.near_duplicates == 0
    # Identical empty strings are exact duplicates; distinct empty-ish texts are kept.
    assert int(result.keep.sum()) == len(set(texts))


def test_signature_of_a_document_longer_than_one_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    import stages.data_prep.minhash as mh

    texts = [" ".join(f"w{i % 997}" for i in range(3000)), "a b c d e f", "x y z"]
    grams = ngram_hashes(word_batch(texts), 5)
    whole = signatures(grams, 32, seed=2)
    monkeypatch.setattr(mh, "_CHUNK_ELEMENTS", 32 * 1000)  # the long document spans 3 chunks
    np.testing.assert_array_equal(signatures(grams, 32, seed=2), whole)
    ref = MinHash(num_perm=32, seed=2, hashfunc=lambda x: x)
    ref.update_batch([int(v) for v in shingle_values32(grams)[grams.doc == 0]])
    np.testing.assert_array_equal(whole[0], ref.hashvalues)


# Importing Ray and the stage in a fresh process takes seconds; a hang guard only.
RAY_DOWN_TIMEOUT_S = 120
RAY_DOWN_CHECK = """
import json, ray
from stages.data_prep.dedup import dedup
from stages.errors import ItoError
try:
    dedup(["a b c"], use_ray=True)
    code = None
except ItoError as e:
    code = str(e.code)
print(json.dumps({"code": code, "ray_up": ray.is_initialized()}))
"""


def test_forcing_ray_without_a_cluster_is_refused() -> None:
    # A process of its own: the session's shared local Ray may be up in this one.
    proc = subprocess.run(
        [sys.executable, "-c", RAY_DOWN_CHECK],
        capture_output=True,
        text=True,
        timeout=RAY_DOWN_TIMEOUT_S,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"code": ErrorCode.ray_unavailable, "ray_up": False}  # none started


def test_banding_finds_the_same_candidates_as_datasketch_minhashlsh() -> None:
    from datasketch import MinHashLSH

    from stages.data_prep.minhash import Banding, candidate_pairs

    texts, _ = planted_pair_corpus(150, 100, seed=6)
    sig = signatures(ngram_hashes(word_batch(texts), 5), 128, seed=1)
    bands, rows = lsh_params(0.8, 128)
    lsh = MinHashLSH(num_perm=128, params=(bands, rows))
    sketches = [MinHash(num_perm=128, seed=1, hashvalues=s, scheme="affine32") for s in sig]
    for i, m in enumerate(sketches):
        lsh.insert(i, m)
    expected = {
        (min(i, j), max(i, j)) for i, m in enumerate(sketches) for j in lsh.query(m) if j != i
    }
    ours = {(int(i), int(j)) for i, j in candidate_pairs(sig, Banding(bands, rows))}
    assert ours == expected and len(ours) >= 50
