"""dsv4/flags.py: snapshot() (read in one pass over the environment) says what get() says."""

import pytest

from dsv4 import flags


def test_snapshot_is_every_switch_as_get_reads_it(monkeypatch):
    bool_flag, int_flag, str_flag = (next(f for f in flags.FLAGS.values() if isinstance(f.default, t) and
                                          (t is not int or not isinstance(f.default, bool)))
                                     for t in (bool, int, str))
    monkeypatch.setenv(bool_flag.env, "on" if not bool_flag.default else "off")
    monkeypatch.setenv(int_flag.env, str(max(int_flag.default, int_flag.minimum or 0) + 3))
    monkeypatch.setenv("DSV4_NOT_A_SWITCH", "1")
    overridden = next(n for n in flags.FLAGS if n not in (bool_flag.name, int_flag.name, str_flag.name))
    with flags.override(**{overridden: "overridden"}):
        got = dict(zip(flags.FLAGS, flags.snapshot()))
        assert got == {name: flags.get(name) for name in flags.FLAGS}
    assert got[bool_flag.name] is (not bool_flag.default)
    assert got[int_flag.name] == max(int_flag.default, int_flag.minimum or 0) + 3
    assert got[str_flag.name] == str_flag.default and got[overridden] == "overridden"
    monkeypatch.setenv(bool_flag.env, "maybe")   # read again at every snapshot, and checked
    with pytest.raises(flags.FlagError, match=bool_flag.env):
        flags.snapshot()
