"""Wire format: round trips, compactness, and named errors for malformed frames."""
import msgpack
import numpy as np
import pytest

from specbench.types import DraftTree, SparseDist
from specbench.worker import protocol
from specbench.worker.protocol import ProtocolError


def test_round_trip_with_arrays():
    frames = protocol.encode({"op": "x", "n": 3}, {"a": np.arange(6, dtype=np.int32).reshape(2, 3)})
    header, arrays = protocol.decode(frames)
    assert header == {"op": "x", "n": 3}
    assert arrays["a"].tolist() == [[0, 1, 2], [3, 4, 5]]


def test_tree_round_trip_shares_sibling_q():
    q = SparseDist((4, 6, 9), (0.5, 0.25, 0.25))
    other = SparseDist((1,), (1.0,))
    tree = DraftTree((4, 6, 1), (-1, -1, 0), (q, q, other))
    arrays = protocol.tree_to_arrays(tree)
    assert arrays["q_len"].tolist() == [3, 1]  # q sent once for both siblings
    assert protocol.tree_from_arrays(arrays) == tree


def test_150_node_tree_fits_in_3_kb():
    parents = tuple([-1] * 10 + [i // 10 for i in range(140)])
    tree = DraftTree(tuple(range(150)), parents)
    frames = protocol.encode({"op": "verify", "session": "abcdef123456-default", "seed": 2**61, "id": 10_000,
                              "client": "0" * 32, "epoch": 1, "committed": 4096,
                              "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "rule": "greedy",
                                           "draft_top_k": 32}}, protocol.tree_to_arrays(tree))
    assert sum(len(f) for f in frames) <= 3 * 1024


@pytest.mark.parametrize("frames,message", [
    ([], "empty message"),
    ([b"\xc1"], "not valid msgpack"),
    ([msgpack.packb([1, 2])], "must be a msgpack map"),
    ([msgpack.packb({"arrays": [["a", "int32", [2]]]})], "announces 1 array frames but 0"),
    ([msgpack.packb({"arrays": [["a", "object", [1]]]}), b"x"], "bad array descriptor"),
    ([msgpack.packb({"arrays": [["a", "int32", [2]]]}), b"abc"], "should be 8 bytes"),
])
def test_malformed_frames(frames, message):
    with pytest.raises(ProtocolError, match=message):
        protocol.decode(frames)


def test_field_types_are_checked():
    with pytest.raises(ProtocolError, match="field 'seed' must be int, got str"):
        protocol.field({"seed": "x"}, "seed", int)
    with pytest.raises(ProtocolError, match="missing field 'op'"):
        protocol.field({}, "op", str)
