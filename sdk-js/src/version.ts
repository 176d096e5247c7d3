/** The SDK's version (kept in step with package.json by the unit tests). */
export const VERSION = '0.1.0'
