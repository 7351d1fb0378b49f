"""Model names are untrusted: every file name made from one is safe and unique."""

from irgen.names import SafeNames, identifier, sanitize


def test_hostile_names_become_safe_path_components():
    for name in ["../x", "a/b", "..", ".", "", "con", "CON.txt", "nul", "x" * 300, "a\\b", "gpu_0/conv1_w_0", "é/ü"]:
        s = sanitize(name)
        assert s and s not in (".", "..") and "/" not in s and "\\" not in s, (name, s)
        assert len(s) <= 100, (name, len(s))
        assert s.split(".")[0].lower() not in {"con", "nul", "prn", "aux"}, (name, s)
    assert sanitize("x" * 300) != sanitize("x" * 299 + "y")  # long names keep a digest


def test_names_are_unique_case_insensitively_and_stable():
    n = SafeNames()
    assert n("a/b") == n("a/b") == "a_b"
    assert n("a_b") == "a_b_1"  # another source name, same file name
    assert n("A/B") == "A_B_2"  # case-folding file systems
    assert n.fresh("a/b") not in {"a_b", "a_b_1", "A_B_2"}
    assert n("a/b") == "a_b"  # the first name stays the name of that source


def test_identifiers():
    assert identifier("0abc/def") == "t0abc_def"
    assert identifier("") == "t"
