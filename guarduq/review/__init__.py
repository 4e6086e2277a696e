"""``guarduq review``: the reviewers' web page over a store (a face: it may import anything below).

``create_review_app(store, ReviewPageSettings(...))`` builds the FastAPI app; ``mount_review(app,
store, settings, prefix="/review")`` puts it inside another app, e.g. ``guarduq serve --review``.
"""

from guarduq.review.app import ReviewPageSettings, create_review_app, mount_review
from guarduq.review.progress import Progress, progress

__all__ = ["Progress", "ReviewPageSettings", "create_review_app", "mount_review", "progress"]
