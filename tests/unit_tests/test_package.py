"""Packaging and layering rules that keep test shims out of the product path."""

import ast
import pathlib
import subprocess
import sys

import megatron_ext

PACKAGE = pathlib.Path(megatron_ext.__file__).parent
REPO = PACKAGE.parent


def _product_modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        if "testing" not in path.relative_to(PACKAGE).parts:
            yield path


def _imported_names(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import: resolve against the file's package
                pkg = path.relative_to(REPO).with_suffix("").parts[: -node.level]
                base = ".".join(pkg + ((base,) if base else ()))
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def test_product_modules_never_import_test_support():
    modules = list(_product_modules())
    assert any(p.name == "__init__.py" for p in modules)
    offenders = [
        f"{p.relative_to(REPO)} imports {name}"
        for p in modules
        for name in _imported_names(p)
        if name == "megatron_ext.testing" or name.startswith("megatron_ext.testing.")
    ]
    assert not offenders, offenders


def test_importing_the_package_leaves_torch_cuda_untouched():
    code = (
        "import torch; before = torch.cuda.current_device;"
        "import megatron_ext, megatron_ext.nonuniform_tp, megatron_ext.fsdp_symm, "
        "megatron_ext.weight_export, sys;"
        "assert 'megatron_ext.testing' not in sys.modules;"
        "assert torch.cuda.current_device is before"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


def test_setup_pins_the_supported_megatron_core_range():
    setup_py = (REPO / "setup.py").read_text()
    assert f'"megatron-core{megatron_ext.SUPPORTED_MEGATRON_CORE}"' in setup_py
    from importlib.metadata import version

    installed = version("megatron-core")
    assert installed.startswith("0.19."), f"tests run on megatron-core {installed}, we claim 0.19.x"
