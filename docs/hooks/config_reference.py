"""mkdocs hook: the page config-reference.md, rendered from the config dataclasses at every
build (``mkdocs build``, ``mkdocs serve``) by :mod:`meshpar.config_reference`. The page exists
only in the build, never as a file in docs/, so it cannot drift from the code."""

from mkdocs.structure.files import File

from meshpar import config_reference

PAGE = "config-reference.md"


def on_files(files, config):
    stale = files.get_file_from_path(PAGE)
    if stale is not None:  # a copy written by hand would shadow the generated page
        files.remove(stale)
    files.append(File.generated(config, PAGE, content=config_reference.render()))
    return files
