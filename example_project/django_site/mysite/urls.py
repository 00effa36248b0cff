from django.urls import include, path
from reports import views

urlpatterns = [
    path("reports/<str:tenant>/", views.start),  # POST: build the tenant's report
    path("reports/<str:tenant>/status", views.status),  # its key's status, as JSON
    path("reports/<str:tenant>/events", views.events),  # the same, live (server-sent events)
    # what a celery-progress bar polls: its own view reads the PROGRESS meta the task stores...
    path("celery-progress/", include("celery_progress.urls")),
    # ...and this one also answers for a queue/join duplicate while it waits
    path("progress/<str:task_id>/", views.progress),
]
