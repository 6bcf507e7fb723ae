"""antsibull-docs lint-collection-docs, with its "Edit on GitHub" path made relative to the right copy.

    python tools/antsibull_docs_lint.py [lint-collection-docs options] COLLECTION_PATH

antsibull-docs (2.28) lints a temporary copy of the collection (``$TMPDIR/antsibull-docs-XXXXXXXX``)
but takes the collection's root from the original, so the "Edit on GitHub" link it renders on line 4 of
every plugin page becomes ``../../../tmp/antsibull-docs-XXXXXXXX/...``. When the random name happens to
end with ``_`` (1 run in 37), reStructuredText reads ``XXXXXXX_`` as a link to a target that does not
exist and the docs gate fails for nothing (seen once in a side-by-side `make test`; reproduced every
time with ``TMPDIR=/tmp/zz_``). The path inside the collection is what the link wants; this wrapper
gives it that and changes nothing else.
"""

from __future__ import annotations

import sys
import typing as t

from antsibull_docs.cli.antsibull_docs import main
from antsibull_docs.write_docs import plugins

_guess = plugins.guess_relative_filename


def _relative_to_the_collection(plugin_record: t.Any, plugin_short_name: str, plugin_type: str, collection_name: str, collection_meta: t.Any) -> str:
    rel = _guess(plugin_record, plugin_short_name, plugin_type, collection_name, collection_meta)
    filename = ((plugin_record or {}).get("doc") or {}).get("filename") or ""
    marker = "/ansible_collections/" + collection_name.replace(".", "/") + "/"
    if rel.startswith("../") and marker in filename:
        return filename.split(marker, 1)[1]
    return rel


plugins.guess_relative_filename = _relative_to_the_collection

if __name__ == "__main__":
    sys.argv = ["antsibull-docs", "lint-collection-docs", *sys.argv[1:]]
    sys.exit(main())
