"""Files and text that cross retrofit's edge: what it writes (all at once, never outside what it owns) and what it
reads or shows of what someone else wrote (bounded, type-checked, one line and no markup).

    from retrofit.io.atomic import atomic_folder, atomic_write_text   # write whole or not at all; one writer a folder
    from retrofit.io.readers import read_json, read_yaml               # JSON / YAML read back as the expected type
    from retrofit.io.escape import md_inline, one_line                 # a foreign value shown in a report or card

Modules: fs (the umask and a folder's fsync) <- atomic; readers; escape. They import only retrofit.errors.
"""
