import os
import sys

# tests import their small models as `import models`
sys.path.insert(0, os.path.dirname(__file__))
