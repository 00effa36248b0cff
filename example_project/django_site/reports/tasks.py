"""Reports built in the background, one run per tenant at a time."""

import time

from celery import shared_task

from celery_singleflight import SingleFlightTask


@shared_task(bind=True, base=SingleFlightTask, lock_key="report:<tenant>")
def build_report(self, tenant, sections=5):
    """A second request while the report is being built joins the run (the site's
    CELERY_SINGLEFLIGHT_ON_DUPLICATE) and gets the same report."""
    for section in range(1, sections + 1):
        time.sleep(0.4)
        self.progress("building", current=section, total=sections, message=f"section {section} of {sections}")
    return {"tenant": tenant, "sections": sections, "fence": self.lease.fence}
