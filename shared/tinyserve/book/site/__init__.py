"""The companion as a website (``make book``): Sphinx + myst-nb + sphinx-book-theme.

    python -m tinyserve.book.site build [--teacher] [--build-dir _build] [--pages PAGE ...]
    python -m tinyserve.book.site check _build/html

``build`` turns the committed, executed notebooks, the labs, the README, the
package reference and a generated claims page into ``_build/html``, without
executing anything, with every warning an error. ``--teacher`` adds the lab
answers and the instructor guide. ``check`` looks at the built HTML: every
internal link and image resolves, nothing loads from another host, and the
Chinese search index holds the chapter's terms.

``build`` holds what the site contains and the Sphinx configuration,
``extension`` what the site adds to the sources, ``check`` the checks.
"""
