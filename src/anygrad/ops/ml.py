"""Classic-ML ops: TfIdfVectorizer (integer n-grams) and ai.onnx.ml's Binarizer and
ArrayFeatureExtractor. Feature extraction, not trained: no gradients (ArrayFeatureExtractor
is a Gather, and differentiates as one)."""
from __future__ import annotations

import numpy as np

from ..errors import UnsupportedOpError
from ..ir.builder import Builder
from ..ir.composite import defcomposite
from ..ir.graph import Node, TensorInfo
from ..ir.registry import defop
from ._util import ints_of, same_as_first

ML = "ai.onnx.ml"


# -- TfIdfVectorizer -------------------------------------------------------------------------
def ngram_pool(node: Node) -> dict[tuple[int, ...], int]:
    """Each pooled n-gram -> its output column. ngram_counts[i] is where the (i+1)-grams start."""
    if node.attr("pool_int64s") is None:
        raise UnsupportedOpError(f"{node.label}: string pools are not supported (anygrad holds no strings)")
    pool, starts, columns = list(node.attr("pool_int64s")), list(node.attr("ngram_counts")), list(node.attr("ngram_indexes"))
    grams = []
    for n, start in enumerate(starts, 1):
        end = starts[n] if n < len(starts) else len(pool)
        grams += [tuple(pool[i:i + n]) for i in range(start, end, n)]
    return dict(zip(grams, columns))


def _tfidf_forward(node: Node, ins: list) -> np.ndarray:
    x = np.asarray(ins[0])
    rows = x.reshape(1, -1) if x.ndim < 2 else x
    pool = ngram_pool(node)
    width = max(node.attr("ngram_indexes")) + 1
    lo, hi = int(node.attr("min_gram_length")), int(node.attr("max_gram_length"))
    counts = np.zeros((len(rows), width))
    for r, row in enumerate(rows.tolist()):
        smallest = lo
        for skip in range(1, int(node.attr("max_skip_count", 0)) + 2):  # distance between items
            for start in range(len(row)):
                for n in range(smallest, hi + 1):
                    last = start + skip * (n - 1)
                    if last >= len(row):
                        break
                    column = pool.get(tuple(row[start:last + 1:skip]))
                    if column is not None:
                        counts[r, column] += 1
            if smallest == 1:  # unigrams do not depend on the skip: count them once
                smallest = 2
                if smallest > hi:
                    break
    mode = node.attr("mode", "TF")
    weights = np.asarray(node.attr("weights") or np.ones(width))
    out = {"TF": counts, "IDF": (counts > 0) * weights, "TFIDF": counts * weights}.get(mode)
    if out is None:
        raise UnsupportedOpError(f"{node.label}: mode '{mode}'; expected TF, IDF or TFIDF")
    out = out.astype(np.float32)
    return out if x.ndim == 2 else out.reshape(-1)


def _tfidf_infer(node: Node, ins: list) -> list[TensorInfo]:
    width = max(node.attr("ngram_indexes")) + 1
    shape = (ins[0].shape[0], width) if len(ins[0].shape) == 2 else (width,)
    return [TensorInfo(np.dtype(np.float32), shape)]


defop("TfIdfVectorizer", infer=_tfidf_infer, forward=_tfidf_forward, nondiff=[0])


# -- ai.onnx.ml ----------------------------------------------------------------------------
defop(f"{ML}.Binarizer", infer=same_as_first, nondiff=[0],
      forward=lambda node, ins: (ins[0] > float(node.attr("threshold", 0.0))).astype(ins[0].dtype))


def _feature_columns(node: Node, value) -> list[int]:
    return ints_of(value, "Y", node)


def _array_feature_infer(node: Node, ins: list) -> list[TensorInfo]:
    x, columns = ins[0], _feature_columns(node, ins[1])
    lead = (1,) if len(x.shape) == 1 else tuple(x.shape[:-1])
    return [TensorInfo(x.dtype, lead + (len(columns),))]


def _array_feature(b: Builder, node: Node) -> list[str]:
    x = node.inputs[0]
    columns = _feature_columns(node, b.info(node.inputs[1]))
    picked = b.op("Gather", [x, b.const(np.asarray(columns, np.int64), np.int64, "columns")], axis=len(b.shape(x)) - 1)
    return [b.reshape(picked, (1, len(columns))) if len(b.shape(x)) == 1 else picked]


defcomposite(f"{ML}.ArrayFeatureExtractor", infer=_array_feature_infer, expand=_array_feature, nondiff=[1])


# -- ai.onnx.ml.TreeEnsemble -------------------------------------------------------------------
COMPARES = {0: np.less_equal, 1: np.less, 2: np.greater_equal, 3: np.greater, 4: np.equal, 5: np.not_equal}
MEMBER = 6


def tree_member_sets(node: Node, modes, true_ids, false_ids, true_leaf, false_leaf, roots) -> dict[int, set]:
    """Set-membership nodes take their sets from membership_values (NaN-separated) in the order a
    depth-first walk (true branch first) reaches them, as ONNX's reference builds its trees."""
    values = iter(np.asarray(node.attr("membership_values"), np.float64).tolist()
                  if node.attr("membership_values") is not None else [])
    sets: dict[int, set] = {}

    def visit(i: int) -> None:
        if modes[i] == MEMBER:
            members = set()
            for v in values:
                if np.isnan(v):
                    break
                members.add(v)
            sets[i] = members
        if not true_leaf[i]:
            visit(true_ids[i])
        if not false_leaf[i]:
            visit(false_ids[i])

    for r in roots:
        if not (true_leaf[r] and false_leaf[r] and true_ids[r] == false_ids[r]):
            visit(r)
    return sets


def _tree_ensemble_forward(node: Node, ins: list) -> np.ndarray:
    x = np.asarray(ins[0])
    a = {k: np.asarray(node.attr(k)).reshape(-1) for k in (
        "nodes_splits", "nodes_featureids", "nodes_modes", "nodes_truenodeids", "nodes_falsenodeids",
        "nodes_trueleafs", "nodes_falseleafs", "leaf_targetids", "leaf_weights", "tree_roots")}
    modes, true_ids, false_ids = a["nodes_modes"].astype(int), a["nodes_truenodeids"], a["nodes_falsenodeids"]
    true_leaf, false_leaf = a["nodes_trueleafs"].astype(bool), a["nodes_falseleafs"].astype(bool)
    missing = node.attr("nodes_missing_value_tracks_true")
    missing = np.asarray(missing, bool).reshape(-1) if missing is not None else np.zeros(len(modes), bool)
    sets = tree_member_sets(node, modes, true_ids, false_ids, true_leaf, false_leaf, a["tree_roots"])
    agg = int(node.attr("aggregate_function", 1))
    if agg not in (0, 1, 2, 3):
        raise UnsupportedOpError(f"{node.label}: aggregate_function {agg} is not supported")
    n_targets = int(node.attr("n_targets"))
    start = {0: 0.0, 1: 0.0, 2: np.finfo(x.dtype).max, 3: np.finfo(x.dtype).min}[agg]
    out = np.full((len(x), n_targets), start, np.float64)
    trees = len(a["tree_roots"])
    for r, row in enumerate(x):
        for root in a["tree_roots"]:
            i, leaf = int(root), bool(true_leaf[root] and false_leaf[root] and true_ids[root] == false_ids[root])
            while not leaf:
                v = row[int(a["nodes_featureids"][i])]
                go = v in sets[i] if modes[i] == MEMBER else bool(COMPARES[modes[i]](v, a["nodes_splits"][i]))
                go = go or bool(missing[i] and np.isnan(v))
                i, leaf = (int(true_ids[i]), bool(true_leaf[i])) if go else (int(false_ids[i]), bool(false_leaf[i]))
            w, t = float(a["leaf_weights"][i]), int(a["leaf_targetids"][i])
            if agg == 0:
                out[r, t] += w / trees
            elif agg == 1:
                out[r, t] += w
            else:
                out[r, t] = (min if agg == 2 else max)(out[r, t], w)
    return out.astype(x.dtype)


defop(f"{ML}.TreeEnsemble", nondiff=[0], forward=_tree_ensemble_forward,
      infer=lambda node, ins: [TensorInfo(ins[0].dtype, (ins[0].shape[0], int(node.attr("n_targets"))))])
