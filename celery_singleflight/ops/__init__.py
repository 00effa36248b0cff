"""The operator surface: who holds a key and how far along it is (:mod:`.status`,
:mod:`.keystatus`, :mod:`.timestatus`), the ``celery singleflight`` command (:mod:`.cli`), and the
least-privilege ACL rule (:mod:`.acl`)."""
