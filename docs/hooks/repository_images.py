"""MkDocs hook: the images under the repository folders in `FOLDERS` join the site at their
repository paths.

A page shows an image by its path from `docs/` (`../benchmarks/results/timelines/x.png`), the
path that also works on GitHub and in a checkout; the benchmarks keep writing their pictures
where they are, nothing is copied into `docs/`, and `mkdocs build --strict` still checks every
image link (a link MkDocs cannot resolve is a warning, which strict turns into an error).
"""

import os

from mkdocs.structure.files import File, InclusionLevel

# Repository folders (from the repository root) whose images the pages show.
FOLDERS = ('benchmarks/results', 'examples')
EXTENSIONS = ('.png', '.jpg', '.svg')


def on_files(files, config):
    root = os.path.dirname(os.path.abspath(config.config_file_path))
    for folder in FOLDERS:
        for dirpath, dirnames, names in os.walk(os.path.join(root, folder)):
            dirnames.sort()
            for name in sorted(names):
                if not name.endswith(EXTENSIONS):
                    continue
                path = os.path.join(dirpath, name)
                # The source path from docs/ is the one pages link; the site keeps the
                # repository's path under its root.
                files.append(File(os.path.relpath(path, config.docs_dir), config.docs_dir,
                                  config.site_dir, config.use_directory_urls,
                                  dest_uri=os.path.relpath(path, root).replace(os.sep, '/'),
                                  # Set here: MkDocs' default exclusion of names starting with a
                                  # dot would take the leading '..' for one.
                                  inclusion=InclusionLevel.INCLUDED))
    return files
