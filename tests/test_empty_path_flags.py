"""An empty path flag (`--out "$DIR"` with DIR unset) is refused by name, never taken as the
current directory (Path("") is "."): tok_train wrote its tokenizer into the working directory."""

import pytest

from nanochat.flags import check_dir_flag, check_out_dir, check_output_file


def test_helpers_refuse_empty_paths(tmp_path):
    for call, flag in ((lambda: check_out_dir("", "--out"), "--out"),
                       (lambda: check_output_file("  ", "--output"), "--output"),
                       (lambda: check_dir_flag("", "--data-dir", "a directory"), "--data-dir")):
        with pytest.raises(ValueError, match=rf"^{flag}: got '\s*'; accepted: .*empty value .*not the current directory"):
            call()
    with pytest.raises(ValueError, match=r"^--data-dir: got '.*nope'; accepted: a directory$"):
        check_dir_flag(str(tmp_path / "nope"), "--data-dir", "a directory")
    check_dir_flag(None, "--data-dir", "a directory")
    check_dir_flag(tmp_path, "--data-dir", "a directory")


@pytest.mark.parametrize("module,argv,flag", [
    ("scripts.tok_train", ["--output-dir", ""], "--output-dir"),
    ("scripts.tok_train", ["--data-dir", ""], "--data-dir"),
    ("scripts.tok_eval", ["--data-dir", ""], "--data-dir"),
    ("scripts.base_eval", ["--data-dir", ""], "--data-dir"),
    ("scripts.mid_train", ["--data-dir", ""], "--data-dir"),
    ("scripts.base_train", ["--data-dir", ""], "--data-dir"),
])
def test_scripts_refuse_empty_path_flags(module, argv, flag, capsys):
    import importlib
    mod = importlib.import_module(module)
    parse = getattr(mod, "parse", None) or getattr(mod, "parse_args", None) or getattr(mod, "parse_config", None)
    with pytest.raises((SystemExit, ValueError)) as e:
        parse(argv)
    said = str(e.value) + capsys.readouterr().err
    assert flag in said and "empty value" in said, said
