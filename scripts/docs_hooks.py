"""The docs build's two additions (mkdocs.yml names this file twice).

As a MkDocs hook (`hooks:`): API pages name public objects as the package root
exports them (``::: tf_asyncps.ResumeTracker``), and the hook points each such
line at the module that defines the object, read from ``_LAZY`` in
``tf_asyncps/__init__.py`` (parsed, not imported: the docs build imports no
TensorFlow). A module moved inside the package then needs only its ``_LAZY``
entry changed, not the docs.

As a griffe extension (mkdocstrings' `extensions:`): the docstrings' Sphinx
roles (:class:`X`, :func:`~a.b`) become code spans (`X`, `b`), which Markdown
shows as names instead of the role's raw text.
"""

import ast
import os
import re

import griffe

_INIT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "tf_asyncps", "__init__.py")
_DIRECTIVE = re.compile(r"^::: tf_asyncps\.(\w+)((?:\.\w+)*)[ \t]*$", re.M)


def root_exports(path=_INIT):
    """``{name: (module, attribute or None)}``: the ``_LAZY`` table of the
    package root, as written in its source.

    Raises:
      ValueError: the file has no literal ``_LAZY = {...}`` assignment.
    """
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and getattr(node.targets[0], "id", None) == "_LAZY"):
            return ast.literal_eval(node.value)
    raise ValueError(f"{path} has no `_LAZY = {{...}}` table: the docs hook reads the "
                     "root's public names from it.")


def resolve(markdown, exports=None):
    """Rewrites ``::: tf_asyncps.NAME[.member]`` lines whose NAME is a lazy
    root export into the defining module's path, headed with the root name.

    Names the root does not export lazily (``tf_asyncps.policies`` and the
    like, real subpackages) are left for mkdocstrings as they are.
    """
    exports = root_exports() if exports is None else exports

    def sub(m):
        name, rest = m.group(1), m.group(2)
        if name not in exports:
            return m.group(0)
        module, attr = exports[name]
        target = module + ("." + attr if attr else "") + rest
        if target == f"tf_asyncps.{name}{rest}":
            return m.group(0)
        return (f"::: {target}\n    options:\n"
                f"      heading: \"tf_asyncps.{name}{rest}\"\n"
                f"      toc_label: \"tf_asyncps.{name}{rest}\"")

    return _DIRECTIVE.sub(sub, markdown)


def on_page_markdown(markdown, page, config, files, **kwargs):
    return resolve(markdown)


_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|obj|exc):`(~?)([^`]+)`")


def plain_roles(text):
    """``:class:`X``` -> ```X```; ``:func:`~a.b``` -> ```b``` (Sphinx's ~)."""
    return _ROLE.sub(lambda m: "`" + (m.group(2).rsplit(".", 1)[-1] if m.group(1)
                                      else m.group(2)) + "`", text)


class SphinxRoles(griffe.Extension):
    """Rewrites each loaded object's docstring with :func:`plain_roles`."""

    def on_object(self, *, obj, **kwargs):
        if obj.docstring is not None:
            obj.docstring.value = plain_roles(obj.docstring.value)
