"""A minimal Django site whose Celery tasks are guarded by celery_singleflight.

Redis comes from ``REDIS_URL``: broker db 0, results db 1, leases db 2.
"""

import os

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379")

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-only-not-a-secret")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
ROOT_URLCONF = "mysite.urls"
INSTALLED_APPS = ["reports"]
DATABASES: dict = {}  # no models in this example
USE_TZ = True

# --8<-- [start:celery]
CELERY_BROKER_URL = f"{REDIS_URL}/0"
CELERY_RESULT_BACKEND = f"{REDIS_URL}/1"
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True

# celery_singleflight's settings: singleflight_* in app.conf, so CELERY_SINGLEFLIGHT_* here
CELERY_SINGLEFLIGHT_REDIS_URL = f"{REDIS_URL}/2"  # where leases live (default: the broker's Redis)
CELERY_SINGLEFLIGHT_NAMESPACE = "mysite"  # the prefix of every Redis key of a lease
CELERY_SINGLEFLIGHT_TTL = 10  # seconds; the heartbeat renews it while the task runs
CELERY_SINGLEFLIGHT_ON_DUPLICATE = "join"  # for tasks that do not choose their own policy
# --8<-- [end:celery]
